"""The pure placement core: (asks, nodes, active placements, strategy, limits) -> Plan. No I/O here."""

from mn_prefect.scheduler.ask import Ask, asks_for_blueprint
from mn_prefect.scheduler.limits import Limits, parse_limits
from mn_prefect.scheduler.plan import plan_asks, plan_job
from mn_prefect.scheduler.view import ClusterView

__all__ = ["Ask", "asks_for_blueprint", "ClusterView", "Limits", "parse_limits", "plan_asks", "plan_job"]
