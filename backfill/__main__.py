from backfill.cli import main

main()
