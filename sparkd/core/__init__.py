"""Pure decisions: no I/O, no clock reads, no asyncio, never config."""
