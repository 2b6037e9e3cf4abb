#include <gtest/gtest.h>
TEST(StoreCudaTest, Placeholder) {}
