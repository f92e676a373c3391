"""Statistics and metrics over replicas: diversity metrics, intervals, arm metrics, health, dynamics."""
