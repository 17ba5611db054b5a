"""Host setup and offline tools: install, doctor, replay."""
