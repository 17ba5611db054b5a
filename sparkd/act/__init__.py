"""Change the world: Docker, the stop procedure, archives, /dev/shm, notifications. Gets what it needs handed in."""
