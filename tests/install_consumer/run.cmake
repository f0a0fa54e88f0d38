# Installs braid into a scratch prefix, then builds and runs a consumer with
# find_package(braid) and with pkg-config; and a DDP-layer consumer.
set(prefix ${BUILD_DIR}/install-test/prefix)
file(REMOVE_RECURSE ${BUILD_DIR}/install-test)
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "install failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install_consumer -B ${BUILD_DIR}/install-test/build
                        -DCMAKE_PREFIX_PATH=${prefix} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer with find_package(braid) failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR}/install-test/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env BRAID_SOCKET_IFNAME=lo LD_LIBRARY_PATH=${prefix}/lib
                        ${BUILD_DIR}/install-test/build/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer (find_package) failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env BRAID_SOCKET_IFNAME=lo LD_LIBRARY_PATH=${prefix}/lib
                        ${BUILD_DIR}/install-test/build/ddp_consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the DDP consumer (find_package, braid::braid_ddp) failed")
endif()
# pkg-config: compile the same program with the flags the .pc file gives.
execute_process(COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${prefix}/lib/pkgconfig pkg-config --cflags --libs braid
                OUTPUT_VARIABLE flags RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE)
if(rc)
  message(FATAL_ERROR "pkg-config does not know braid")
endif()
separate_arguments(flags UNIX_COMMAND "${flags}")
execute_process(COMMAND cc ${SOURCE_DIR}/tests/install_consumer/main.c ${flags} -o ${BUILD_DIR}/install-test/consumer-pc
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "compiling with pkg-config flags failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env BRAID_SOCKET_IFNAME=lo LD_LIBRARY_PATH=${prefix}/lib
                        ${BUILD_DIR}/install-test/consumer-pc RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer (pkg-config) failed")
endif()
