"""Decisions over cluster state (SPEC section 7): node states, maintenance, the reconciler's leadership.

Imports the store, model and scheduler layers only; effects go through the store. The one exception is
``mn_prefect.notify``, which a node going healthy or offline queues a webhook notification with (it never waits).
"""

from mn_prefect.lifecycle.leader import Leadership, NotLeader
from mn_prefect.lifecycle.maintenance import NodeStateRefused, set_maintenance, undrain
from mn_prefect.lifecycle.states import Transition, advance_node_states

__all__ = ["Leadership", "NodeStateRefused", "NotLeader", "Transition", "advance_node_states", "set_maintenance",
           "undrain"]
