"""The fleet's certificate authority: the device CA (an offline root, the online devices
intermediate), the claims CA, the broker's certificate, each device's certificate issued from its
checked CSR, the issued-certificates ledger and the CRL the broker reads (docs/enrollment.md)."""
