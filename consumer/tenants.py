"""A tenant as the registry hands it out (TenantView), and the listing of tenants through SQLAlchemy Core.

`lorabatch tenants list` reads here: a Core select on the registry's `tenants` table loads neither the
ORM nor the registry's models, which are most of what the command would otherwise spend starting up
(`import sqlalchemy.orm` plus the declarative models cost about 0.3 s here, the whole listing under 0.5 s).
The registry (consumer.registry) writes tenants through the ORM and builds the same TenantView from its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, column, select, table


@dataclass(frozen=True)
class TenantView:
    id: str
    display_name: str
    tier: str
    weight: int
    requests_per_minute: int = 0  # 0: unlimited
    tokens_per_minute: int = 0


# billing.models.Tenant's table as Core sees it: the columns a TenantView holds, in its field order
# (tests/test_registry.py checks each one is a column of the model).
TENANTS = table("tenants", column("id"), column("display_name"), column("tier"), column("weight"),
                column("requests_per_minute"), column("tokens_per_minute"))


def list_tenants(db: Engine) -> list[TenantView]:
    """Every tenant, by id: what Registry.list_tenants returns, without the ORM."""
    with db.connect() as connection:
        return [TenantView(*row) for row in connection.execute(select(TENANTS).order_by(TENANTS.c.id))]
