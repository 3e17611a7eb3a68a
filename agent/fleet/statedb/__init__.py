"""The controller's state on PostgreSQL: the connection, the schema's migrations, the lease row."""
