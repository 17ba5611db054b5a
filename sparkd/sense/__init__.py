"""Read the world, never write it."""
