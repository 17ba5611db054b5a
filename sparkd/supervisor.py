"""Container side of the daemon: chooses monitor-only or the Docker supervisor."""

from __future__ import annotations

from .config import Settings
from .daemon import Actions, MonitorOnly


def make_actions(settings: Settings) -> Actions:
    c = settings.container
    if not c.image and not c.guard:
        return MonitorOnly("no container configured (container.image or container.guard)")
    return MonitorOnly("container manager not available yet")
