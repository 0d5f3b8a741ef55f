"""The HTTP layer: dependencies, error mapping, one router module per resource."""
