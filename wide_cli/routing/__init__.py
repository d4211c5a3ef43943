"""Token-level routing: routers, Gumbel decisions, the routed decoder layer (DESIGN.md §1)."""

from wide_cli.routing.config import GroupLayout, RoutingConfig, resolve_groups
from wide_cli.routing.model import attach_routers, router_parameters, router_state_dict
from wide_cli.routing.state import RoutingState, SparsityCounter

__all__ = [
    "GroupLayout",
    "RoutingConfig",
    "RoutingState",
    "SparsityCounter",
    "attach_routers",
    "resolve_groups",
    "router_parameters",
    "router_state_dict",
]
