# Read by ctest after the tests gtest_discover_tests found. ctest -j starts
# the tests of highest COST first; a fresh build tree (CI's) has no timings
# from earlier runs, and the two longest tests (about 220 s and 160 s on 2
# cores) would otherwise start near the end and finish alone.
set_tests_properties(CudaSources.CompileForSm90WithNvccInACpuBuild
                     Install.InstalledPackageBuildsAndTrainsTheTemplateAndTheExamples
                     Template.BuildsAndTrainsOneEpoch
                     PROPERTIES COST 1000)
