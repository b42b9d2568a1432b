"""Export: what the daemon publishes (the exposition model, Prometheus metrics, the web config)."""
