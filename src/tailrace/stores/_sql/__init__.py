"""SQL shared by the SQLite and Postgres stores: schema, migrations, statements, row codecs,
the transaction bodies (``_transactions``) and the base class that runs them (``_base``).

Statements are written once in SQLite's ``?`` style; Postgres turns them into
its own with ``postgres._sql.pg``.
"""
