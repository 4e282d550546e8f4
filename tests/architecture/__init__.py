"""The house: the import contract, what the wheel ships, and the paths docs/impl.md lists."""
