"""Traffic capture at the gateway (recorder, file format, redaction), inspection and replay."""
