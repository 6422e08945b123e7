"""Tenancy: tenants and their API keys, authentication, token budgets, limits, usage and the admin API."""
