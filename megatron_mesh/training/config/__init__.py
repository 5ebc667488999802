"""The driver's flags: the parser, its checks and the typed configuration they make."""
