"""Token-level routing: routers, Gumbel decisions, the routed decoder layer (DESIGN.md §1).

Parts of this package's source are copied *verbatim* into every ``--format hf`` export: the
definitions listed in ``wide_cli.export.modeling_template.COPIED`` (``GroupLayout``, ``Router``,
the Gumbel/argmax decisions, ``SparsityCounter``, ``RoutingState``, the routed layer functions)
are pasted with ``inspect.getsource`` into the export's ``modeling_wide.py``, and the constants
in ``CONSTANTS`` (``state.MODULES``, ``state.MODES``) by value. Hence, for those definitions:

- they may use only ``torch``, ``transformers``, the standard library and each other (the export
  loads where wide is not installed); no imports of other ``wide_cli`` modules inside them;
- any change to their text changes the generated code, and wide refuses to load an hf export
  whose shipped code differs from what this version generates (without ``--trust-remote-code``):
  exports made before the change must be re-exported. ``tests/export/test_hf_format.py`` checks
  the copy is identical.

Code that is not copied (``model.py``'s helpers, ``measure.py``) may import anything of wide.
"""

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
