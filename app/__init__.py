"""kvmosaic application layer: settings, HTTP API, web demo and the command line."""
