"""The asyncio side of aiolayer: the loop thread and everything that runs on it."""
