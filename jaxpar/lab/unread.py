"""The config keys a plan's or a sweep's layouts do not read: one warning for a key none
of them reads, none for a key only some of them do (a plan's pipeline keys mean nothing to
its layouts without stages, each of which warned of them)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from jaxpar.config import Config, apply_overrides
from jaxpar.errors import JaxparError
from jaxpar.lab.measure import layout_overrides
from jaxpar.run import unused_flags
from jaxpar.task import Task
from jaxpar.unused import unused_settings

#: the warning :func:`jaxpar.unused.warn_unused` gives of a key one run does not read
UNUSED = r"config key '.*' has no effect with "


@contextlib.contextmanager
def unused_once(config: Config, layouts: list[str], task: Task | None) -> Iterator[None]:
    """Around measuring ``layouts`` of ``config``: a key that some of them read is no
    warning for those that do not (a plan's pipeline keys mean nothing to its layouts
    without stages, which warned each); a key none of them reads is one warning."""
    flags = unused_flags(config, task)
    unread: set[str] | None = None
    for layout in layouts:
        try:
            keys = unused_settings(apply_overrides(config, layout_overrides(layout)), **flags)
        except JaxparError:  # a layout that cannot run: its row says why
            continue
        unread = set(keys) if unread is None else unread & set(keys)
        if not unread:
            break
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", UNUSED)
        yield
    for key in sorted(unread or ()):
        warnings.warn(
            f"config key '{key}' has no effect on any of the {len(layouts)} layouts",
            stacklevel=3,
        )
