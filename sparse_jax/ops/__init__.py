"""Public ops: each dispatches between a Pallas kernel and a pure-jnp reference."""
