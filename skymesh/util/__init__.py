"""Small helpers shared by the product and the lab (standard library only)."""
