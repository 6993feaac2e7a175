"""The ledger's operational failures: typed, with a `retriable` flag and a message that says how to fix them."""

from __future__ import annotations


class LedgerError(Exception):
    """Base of every failure the ledger reports to its callers."""

    retriable = False


class LedgerConfigError(LedgerError):
    """The ledger URL names a database or driver the ledger does not support."""


class LedgerRecordError(LedgerError, ValueError):
    """A usage or adapter-load record cannot be written as it is; nothing of its batch was written."""


class InvalidPeriodError(LedgerError, ValueError):
    """A billing period is not written as YYYY-MM."""


class LedgerSchemaError(LedgerError):
    """The database has no ledger schema (or an older one): migrations have not been run against it."""


class LedgerUnavailableError(LedgerError):
    """The database did not answer or refused the write; the write is idempotent, so retrying is safe."""

    retriable = True


class PriceError(LedgerError, ValueError):
    """A price-list entry cannot be written as given (negative, too precise, bad name)."""


class PriceCurrencyError(LedgerError, ValueError):
    """Usage would be priced with a price-list entry set in a currency other than the invoice's (ledger.currency)."""


class UnpricedGpuKindError(LedgerError, ValueError):
    """Usage or a load ran on a GPU kind with no price in effect for it: billing it at another kind's price would be a guess."""


class PeriodNotEndedError(LedgerError, ValueError):
    """A period cannot be closed before it has ended: its usage is still arriving."""


class UnknownTenantError(LedgerError, ValueError):
    """A tenant id that neither the registry nor the ledger holds: nothing can be billed to it."""


class UnbillablePeriodError(LedgerError, ValueError):
    """A well-formed period that cannot be billed: outside the years the ledger bills, or not begun and empty."""


class MixedCurrencyError(LedgerError, ValueError):
    """A period's invoices are in more than one currency (some closed under another ledger.currency): no report adds them."""
