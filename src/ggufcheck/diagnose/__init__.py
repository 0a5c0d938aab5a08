"""The diagnosis: ordered stages, each eliminating one variable, and the verdict."""
