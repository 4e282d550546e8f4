"""Sessions: the manager and its spill, restore, fork and maintenance paths, over the catalog."""
