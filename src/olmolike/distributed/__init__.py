"""Distributed helpers: process groups, rank utilities, failure handling."""
