"""Alembic environment and revisions of the ledger schema.

Processes pass SCRIPT_LOCATION to billing.db (`upgrade(url, script_location=SCRIPT_LOCATION)`); billing
itself never imports this package. `alembic ...` from the repository root finds it through alembic.ini.
"""

from pathlib import Path

SCRIPT_LOCATION = str(Path(__file__).parent)
