"""The node side: every program that runs on a node or inside a rank (see ARCHITECTURE.md)."""
