"""Decisions over cluster state (docs/operating.md): node states, maintenance, the reconciler's leadership.

Imports the placement, store, model and scheduler layers only; effects go through them. The exceptions are
``mn_prefect.notify``, which a node going healthy or offline queues a webhook notification with, and
``mn_prefect.events``, which every change queues its Prefect event with (neither ever waits).
"""

from mn_prefect.lifecycle.leader import Leadership, NotLeader
from mn_prefect.lifecycle.maintenance import NodeStateRefused, set_maintenance, undrain
from mn_prefect.lifecycle.states import Transition, advance_node_states, heartbeat

__all__ = ["Leadership", "NodeStateRefused", "NotLeader", "Transition", "advance_node_states", "heartbeat",
           "set_maintenance", "undrain"]
