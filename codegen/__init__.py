"""skuforge's generator: the matrix, Jinja rendering, the manifest and the CLI."""

