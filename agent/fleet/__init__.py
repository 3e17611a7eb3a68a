"""Operator side: keygen, sign, deploy, serve chunks, status, commands."""
