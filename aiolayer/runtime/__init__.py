"""The asyncio side of aiolayer: the loop thread and everything that runs on it. ``send/`` is P's side,
``receive/`` D's, ``control/`` the control plane; the shared pieces and the ``Runtime`` facade sit here
(docs/design.md lists every module)."""
