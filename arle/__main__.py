from arle.cli.app import main

main()
