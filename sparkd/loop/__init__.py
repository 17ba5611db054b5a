"""asyncio, clocks and mutable state: the daemon, the guard, the supervisor."""
