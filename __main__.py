from npuc.cli.main import main

main()
