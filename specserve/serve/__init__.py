"""Ray Serve adapters around the engine (ingress, coordinator, workers). Imports ray; the engine never does."""
