"""verl side of qerl-plugin, loaded through the ``verl.plugins`` entry point.

verl's loader imports this module and never calls anything in it, and it logs import errors only at
DEBUG: so importing this module is the registration, it must not fail, and it must stay cheap (it runs
on every ``import verl``, in every Ray worker).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("qerl.verl")
REGISTERED = True
logger.debug("qerl-plugin verl extension loaded")
