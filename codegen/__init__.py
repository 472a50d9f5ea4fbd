"""skuforge's generator: the matrix, Jinja rendering, the manifest and the CLI."""

GENERATOR_VERSION = "0.1.0"
