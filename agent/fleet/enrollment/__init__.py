"""The controller's enrollment desk: devices holding only a claim ask for their own certificate,
are admitted by policy (registered ids or serials at once, others pending an operator), and enrolled
devices renew over their own connection (docs/enrollment.md)."""
