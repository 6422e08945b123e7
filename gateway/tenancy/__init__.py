"""Tenancy: tenants and their API keys, authentication, token budgets, limits, usage, and what
an operator may send the admin API (its routes are ``gateway.http.admin``)."""
