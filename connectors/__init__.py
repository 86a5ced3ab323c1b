"""kvconnect package."""
