"""vime's own flags, one module per concern; :data:`VIME_GROUPS` lists them in ``--help`` order."""

from __future__ import annotations

from vime.utils.flags.algorithm import ALGORITHM
from vime.utils.flags.checkpoint import CHECKPOINT, SYNC
from vime.utils.flags.cluster import CLUSTER
from vime.utils.flags.data import DATA
from vime.utils.flags.eval import EVAL
from vime.utils.flags.logging import DEBUG_AND_LOGGING
from vime.utils.flags.rollout import REWARD, ROLLOUT
from vime.utils.flags.schedule import SCHEDULE

VIME_GROUPS = [
    ("cluster", CLUSTER),
    ("data", DATA),
    ("rollout", ROLLOUT),
    ("reward", REWARD),
    ("schedule", SCHEDULE),
    ("algorithm", ALGORITHM),
    ("checkpoint (see also the megatron group)", CHECKPOINT),
    ("weight sync", SYNC),
    ("eval", EVAL),
    ("debug and logging", DEBUG_AND_LOGGING),
]
