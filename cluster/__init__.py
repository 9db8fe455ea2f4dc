"""v4serve's top layer: composes the pools, the registry and the routers into a cluster (`v4serve up`,
the launcher, the autoscaler and its actuators, the CLI, the environment settings). Nothing below imports it."""
