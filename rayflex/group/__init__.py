"""The workers of one run attempt: spawning, polling and releasing them, the
placement-group reservation their bundles live in, and the standby pool."""
