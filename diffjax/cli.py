"""Moved to :mod:`diffjax.errors`; this name stays until every caller imports from there."""

from diffjax.errors import UserError, run_guarded, user_errors  # noqa: F401
