"""The two names reproduce.py still imports from here: the audit is perinstance/audit_simulation.py and
the membership attack perinstance/membership.py. Delete this module once reproduce.py imports them
from there."""

from perinstance.audit_simulation import audit_summary
from perinstance.membership import membership_summary

__all__ = ["audit_summary", "membership_summary"]
