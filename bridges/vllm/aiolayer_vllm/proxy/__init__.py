"""The P/D proxy: an OpenAI-compatible front end that owns the P->D request flow."""
