"""The serving container's lifecycle as data: one ``ContainerState`` and (to come in
this module) a pure transition function over observations of what Docker says *now*.

States (the values are what status, events, the API, the exporter and templates show):

* ``none``: no container known (monitor-only, or not launched yet);
* ``starting``: running, vLLM's ``/health`` not answering 200 yet;
* ``ready``: running and healthy;
* ``unhealthy``: running, but ``/health`` fails or no progress while requests wait;
* ``restarting``: Docker's restart policy is cycling it (Docker may even say running);
* ``stopping``: sparkd's stop procedure is under way;
* ``stopped``: stopped by sparkd (a rule, the hard floor or an operator);
* ``exited``: ended on its own (exit code recorded);
* ``failed``: a launch that did not reach ready;
* ``unknown``: the Docker engine does not answer.
"""

from __future__ import annotations

from enum import StrEnum


class ContainerState(StrEnum):
    NONE = "none"
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    EXITED = "exited"
    FAILED = "failed"
    UNKNOWN = "unknown"


RUNNING_STATES = frozenset({ContainerState.STARTING, ContainerState.READY, ContainerState.UNHEALTHY})
