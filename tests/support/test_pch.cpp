// The owner of the test programs' precompiled header (tests/CMakeLists.txt): a program that
// does nothing, compiled with the test programs' options.
int main() { return 0; }
