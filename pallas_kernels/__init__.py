"""GPU kernels with their pure-jnp references; see each op's folder."""
