"""Dynamic-sampling filters: ``--dynamic-sampling-filter-path`` picks one to keep or drop each group."""

from vime.rollout.filter_hub.base_types import DynamicFilterOutput

__all__ = ["DynamicFilterOutput"]
